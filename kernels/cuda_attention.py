"""The CUDA backend's attention: K/V writes, paged attention over block tables (kernels/attention.cu, or the
sm_90a prefill kernels of kernels/attention_sm90.py where tuning picks them) and sliding-window attention over
per-sequence rings.
"""
from __future__ import annotations

import cupy
import numpy as np

from prefixrun.kernels import attention_sm90
from prefixrun.kernels.cuda_arrays import BF16, F32, THREADS, blocks_for, device_index, head_view, i32, i64, \
    type_name
from prefixrun.kernels.cuda_modules import KV8_MMA_HEAD_DIMS, MMA_HEAD_DIMS, kernel
from prefixrun.kernels.ring_rows import gather_rows, kept_rows
from prefixrun.kernels.tuning import attention_plan, attn_mma_smem_bytes

_LOG2E = 1.4426950408889634
_NULL = np.uint64(0)  # a kernel's absent pointer argument (no sinks)


def _sink_logits(sinks, hq: int):
    """Attention sinks as the kernels read them: contiguous fp32 [Hq] on the device, or None."""
    if sinks is None:
        return None
    sinks = cupy.ascontiguousarray(cupy.asarray(sinks, dtype=F32))
    if sinks.shape != (hq,):
        raise ValueError(f"sinks {sinks.shape} must be one logit per query head ({hq})")
    return sinks

def _kv8_type(cache) -> str:
    """The kernels' type of an 8-bit K/V cache's elements (kernels/kv_storage.py: int8, or fp8 bytes as uint8)."""
    if cache.dtype == cupy.int8:
        return "signed char"
    if cache.dtype == cupy.uint8:
        return "e4m3"
    raise ValueError(f"a K/V cache with scales must be int8 or fp8 (uint8), not {cache.dtype}")


def _scales(k_scale, v_scale, cache) -> tuple:
    """(the kernel module, the scale pointers) of caches stored as `cache` with these scales (None: unquantised)."""
    if k_scale is None and v_scale is None:
        return "attention", _NULL, _NULL
    if k_scale is None or v_scale is None or k_scale.dtype != F32 or v_scale.dtype != F32:
        raise ValueError("8-bit K/V caches need fp32 scales for both K and V")
    if not (k_scale.flags.c_contiguous and v_scale.flags.c_contiguous) or k_scale.shape != v_scale.shape \
            or k_scale.shape != cache.shape[:-1] + (cache.shape[-1] // 32,):
        raise ValueError(f"K/V scales {k_scale.shape} do not fit caches {cache.shape} (contiguous, one per 32)")
    _kv8_type(cache)
    return "attention_q8", k_scale, v_scale


class AttentionOps:
    """CudaOps' attention ops (its `tuning`, `_sm_count`, `_wgmma`, `_cast`, `_dynamic_smem` and `upload_index`)."""

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
        """Store new K/V rows [T, Hkv, D] at flat positions slot_mapping [T] (block * block_size + offset), rounded
        to the caches' dtype or, with scales, quantised (kernels/kv_storage.py) into 8-bit caches."""
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("K/V caches must be contiguous pools")
        if v.dtype != k.dtype:
            v = self._cast(v, k.dtype)
        k, kst, ksh = head_view(k)
        v, vst, vsh = head_view(v)
        t, h, d = k.shape
        if k_cache.shape[2:] != (h, d) or v_cache.shape[2:] != (h, d) or v.shape != k.shape:
            raise ValueError(f"K/V rows {k.shape}/{v.shape} do not fit caches {k_cache.shape}/{v_cache.shape}")
        if t == 0:
            return
        module, ks, vs = _scales(k_scale, v_scale, k_cache)
        if module == "attention_q8":
            kernel(module, f"write_kv_q8_kernel<{type_name(k.dtype)}, {_kv8_type(k_cache)}>")(
                (blocks_for(2 * t * h * (d // 32)),), (THREADS,),
                (k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), i64(t), i32(h), i32(d), device_index(slot_mapping),
                 k_cache, v_cache, ks, vs))
            return
        kernel("elementwise", f"write_kv_kernel<{type_name(k.dtype)}, {type_name(k_cache.dtype)}>")(
            (blocks_for(t * h * d),), (THREADS,), (k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), i64(t), i32(h),
                                               i32(d), device_index(slot_mapping), k_cache, v_cache))

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens, scale,
                        sliding_window=None, shared=None, sinks=None, k_scale=None, v_scale=None, prefill=False):
        """Causal attention of each sequence's new queries over its paged K/V (new rows already written).

        q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]; context_lens [B];
        cu_seqlens [B+1]. A query at position p sees keys in (p - W, p] with W = sliding_window. -> [T, Hq, D].
        `shared` (decode, engine.step.forward_batch.SharedPrefixes): each group's shared prefix is read once for all
        its members (cascade: a pass per group over the shared keys, a pass per sequence over the rest, then a
        merge). `sinks` fp32 [Hq] (gpt-oss): added where each path normalises (the sm_90a prefill kernels and the
        mma.sync ones at their output, the cascade and split-K merges when they combine partials). 8-bit caches
        (`k_scale`, `v_scale` fp32 [..., Hkv, D / 32]) are read as stored: the tensor-core kernels (mma.sync, and the
        sm_90a prefill on its serial schedule) copy each tile's bytes and scales into shared memory asynchronously,
        a tile ahead, and dequantise them to bf16 there just before the MMAs that read them; the fp32 scalar kernel
        dequantises in registers. `prefill`: a prefill step (deterministic tunings compute its rows in one pass,
        decode and verify rows over fixed key ranges: `_segments`)."""
        q, qst, qsh = head_view(q)
        t, hq, d = q.shape
        nb, bs, hkv, dc = k_cache.shape
        if dc != d or v_cache.shape != k_cache.shape or hq % hkv:
            raise ValueError(f"q {q.shape} does not fit caches {k_cache.shape}/{v_cache.shape}")
        if d > 256:
            raise ValueError(f"head_dim up to 256 supported, got {d}")
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("K/V caches must be contiguous pools")
        window = 0
        if sliding_window is not None:
            window = int(sliding_window)
            if window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        out = cupy.empty((t, hq, d), q.dtype)
        sinks = _sink_logits(sinks, hq)
        tables, ctx, cu = device_index(block_tables), device_index(context_lens), device_index(cu_seqlens)
        nseq = ctx.shape[0]
        if t == 0 or nseq == 0:
            return out
        module, ks, vs = _scales(k_scale, v_scale, k_cache)
        kv8 = module == "attention_q8"
        use_mma = (q.dtype == BF16 and d in (KV8_MMA_HEAD_DIMS if kv8 else MMA_HEAD_DIMS)
                   and (k_cache.dtype == BF16 or kv8) and q.data.ptr % 16 == 0 and qst % 8 == 0 and qsh % 8 == 0
                   and (not kv8 or all(a.data.ptr % 16 == 0 for a in (k_cache, v_cache, ks, vs))))
        plan = attention_plan(self.tuning, self._sm_count, tokens=t, seqs=nseq, q_heads=hq, kv_heads=hkv, head_dim=d,
                              table_width=tables.shape[1], block_size=bs, window=window, tensor_cores=use_mma,
                              shared=shared is not None, wgmma=self._wgmma, prefill=prefill, kv8=kv8)
        if plan.path == "wgmma":
            attention_sm90.prefill(q=q, qst=qst, qsh=qsh, k_cache=k_cache, v_cache=v_cache, tables=tables, ctx=ctx,
                                   cu=cu, nseq=nseq, tokens=t, hq=hq, hkv=hkv, d=d, bs=bs,
                                   scale_log2=scale * _LOG2E, window=window, out=out, schedule=plan.schedule,
                                   sm_count=self._sm_count, sinks=sinks, kv=_kv8_type(k_cache) if kv8 else None,
                                   k_scale=ks, v_scale=vs)
            return out
        if plan.path == "scalar":  # fp32 (exactness) path: plain attention; a shared prefix gives the same answer
            cache_type = _kv8_type(k_cache) if kv8 else type_name(k_cache.dtype)
            kern = kernel(module, f"attn_scalar_kernel<{type_name(q.dtype)}, {cache_type}>")
            kern((t, -(-hq // 4)), (128,), (q, i64(qst), i64(qsh), k_cache, v_cache, tables,
                                            i32(tables.shape[1]), ctx, cu, i32(nseq), i32(hq), i32(hkv),
                                            i32(d), i32(bs), np.float32(scale), i32(window), out,
                                            sinks if sinks is not None else _NULL, ks, vs))
            return out
        mma = dict(q=q, qst=qst, qsh=qsh, k_cache=k_cache, v_cache=v_cache, bs=bs, hq=hq, hkv=hkv, d=d,
                   scale=scale, window=window, out=out, sinks=sinks, kv=(module, ks, vs))
        splits = plan.splits
        if plan.path in ("segments", "segments-cascade"):
            return self._segments(plan, mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, hq=hq, d=d,
                                  shared=shared if plan.path == "segments-cascade" else None)
        if plan.path == "cascade":
            return self._cascade(plan, mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, shared=shared)
        if plan.path == "split":
            part = (cupy.empty((splits, t * hq, d), F32), cupy.empty((splits, t * hq, 2), F32))
            self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, nw=plan.warps, bn=plan.keys,
                            splits=splits, part=part)
            self._attn_merge(*part, splits, t * hq, d, out, sinks, hq, module)
            return out
        self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, nw=plan.warps, bn=plan.keys)
        return out

    def _cascade(self, plan, mma: dict, *, tables, ctx, cu, nseq, tokens, shared):
        """A decode step's shared prefixes (plan "cascade"): partials of each group's shared keys split over
        `plan.splits` ranges, then one per row over its own keys, merged."""
        splits, hq, d = plan.splits, mma["hq"], mma["d"]
        part = (cupy.empty((splits + 1, tokens * hq, d), F32), cupy.empty((splits + 1, tokens * hq, 2), F32))
        self._attn_pass(**mma, tables=device_index(shared.tables), ctx=device_index(shared.lens),
                        cu=device_index(shared.cu), nseq=shared.lens.shape[0], tokens=tokens, nw=plan.warps,
                        bn=plan.keys, splits=splits, mode=1, slot_base=0, part=part,
                        row_tok=device_index(shared.order), kv_from=ctx)
        self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=tokens, nw=plan.own_warps,
                        bn=plan.keys, mode=2, slot_base=splits, part=part, row_tok=cu,
                        kv_from=device_index(shared.start))
        self._attn_merge(*part, splits + 1, tokens * hq, d, mma["out"], mma["sinks"], hq, mma["kv"][0])
        return mma["out"]

    def _segments(self, plan, mma: dict, *, tables, ctx, cu, nseq, tokens, hq, d, shared):
        """--deterministic's decode and verify rows (kernels/attention.cu, seg_tiles): each row's partial over each
        fixed key range [s W, (s + 1) W) in a slot of its own, merged in range order. With `shared` (a decode
        step's groups) the ranges wholly inside a group's shared prefix are computed once for the group into slots
        [0, S), every row's other ranges into [S, 2 S): the partials and their order are a plain pass's, so the
        bits are too, whatever the groups."""
        s = plan.splits
        slots = 2 * s if shared is not None else s
        part = (cupy.empty((slots, tokens * hq, d), F32), cupy.empty((slots, tokens * hq, 2), F32))
        if shared is not None:  # the kernel cuts each group's prefix, and where each row's own keys begin, down to
            # the last range boundary (the ranges a group's prefix holds whole)
            self._attn_pass(**mma, tables=device_index(shared.tables), ctx=device_index(shared.lens),
                            cu=device_index(shared.cu), nseq=shared.lens.shape[0], tokens=tokens, nw=plan.warps,
                            bn=plan.keys, splits=s, mode=1, slot_base=0, part=part,
                            row_tok=device_index(shared.order), kv_from=ctx, seg_tiles=plan.segment_tiles)
            self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=tokens, nw=plan.own_warps,
                            bn=plan.keys, splits=s, mode=2, slot_base=s, part=part, row_tok=cu,
                            kv_from=device_index(shared.start), seg_tiles=plan.segment_tiles)
        else:
            self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=tokens, nw=plan.warps,
                            bn=plan.keys, splits=s, part=part, seg_tiles=plan.segment_tiles)
        self._attn_merge(*part, slots, tokens * hq, d, mma["out"], mma["sinks"], hq, mma["kv"][0])
        return mma["out"]

    def _attn_pass(self, *, q, qst, qsh, k_cache, v_cache, bs, hq, hkv, d, scale, window, out, tables, ctx, cu, nseq,
                   tokens, nw, bn, splits=1, mode=0, slot_base=0, part=None, row_tok=None, kv_from=None, sinks=None,
                   kv=None, seg_tiles=0):
        """One launch of attn_mma_kernel (see kernels/attention.cu for the modes). Without `part` it writes `out`;
        with it, partials into slots slot_base + split of part = ([slots, T * Hq, D], [slots, T * Hq, 2]).
        `kv`: (the module, K scales, V scales) of the caches' storage (`_scales`); `seg_tiles` > 0: split s takes
        the key tiles [s seg_tiles, (s + 1) seg_tiles) from position 0."""
        if part is not None and splits == 1 and mode == 0 and seg_tiles == 0:
            raise ValueError("a plain pass with one split writes `out`, not partials")
        module, ks, vs = kv or ("attention", _NULL, _NULL)
        kv8 = module == "attention_q8"
        name = f"attn_mma_kernel<{d}, {bn}, {nw}" + (f", {_kv8_type(k_cache)}>" if kv8 else ">")
        kern = kernel(module, name)
        smem = attn_mma_smem_bytes(d, bn, nw, kv8)
        self._dynamic_smem(kern, smem)
        rep = hq // hkv
        part_o, part_ml = part if part is not None else (out, out)
        grid = ((-(-tokens * rep // (16 * nw)) + nseq) * splits, hkv)
        kern(grid, (32 * nw,), (q, i64(qst), i64(qsh), k_cache, v_cache, tables, i32(tables.shape[1]), ctx, cu,
                                i32(nseq), i32(hq), i32(hkv), i32(bs), np.float32(scale * _LOG2E), i32(window),
                                out, i32(splits), part_o, part_ml, i32(mode), i32(slot_base), i64(tokens),
                                row_tok if row_tok is not None else cu, kv_from if kv_from is not None else cu,
                                sinks if sinks is not None and part is None else _NULL,  # partials: the merge adds it
                                ks, vs, i32(seg_tiles)),
             shared_mem=smem)

    @staticmethod
    def _attn_merge(part_o, part_ml, slots, rows, d, out, sinks, hq, module="attention"):
        kernel(module, "attn_combine_kernel")((rows,), (128,), (part_o, part_ml, i32(slots), i64(rows), i32(d),
                                                                      out, sinks if sinks is not None else _NULL,
                                                                      i32(hq)))

    def ring_attention(self, q, k, v, k_ring, v_ring, slots, cu_seqlens, context_lens, scale, max_context,
                       sinks=None, k_scale=None, v_scale=None):
        """Sliding-window attention over per-sequence K/V rings (see NumpyOps.ring_attention for the contract).

        A ring pool [num_slots, W, Hkv, D] is laid out exactly like a paged pool with block size W, and a
        sequence's position p lives at row p % W of its slot, so attention runs on the paged kernel with a block
        table that repeats the slot. Decode (one new token per sequence) writes the token first — the row it
        overwrites, position p - W, is outside the window. Prefill must not overwrite rows its earlier queries
        still see, so it gathers ring + new rows into a temporary cache (one block per sequence), attends there,
        and then writes the kept new rows into the ring. 8-bit rings (`k_scale`, `v_scale`) carry their scales
        through the same moves, and the new rows enter the temporary cache quantised, as the ring will hold them."""
        w = k_ring.shape[1]
        t, nseq = q.shape[0], slots.shape[0]
        if t == 0:
            return cupy.empty(q.shape, q.dtype)
        if t == nseq:  # decode: write, then attend with the slot repeated as every block (no host sync)
            slots_d = device_index(slots).astype(cupy.int32)
            ctx_d = device_index(context_lens).astype(cupy.int32)
            self.write_kv(k_ring, v_ring, k, v, slots_d * w + (ctx_d - 1) % w, k_scale, v_scale)
            nblk = -(-int(max_context) // w)
            tables = cupy.ascontiguousarray(cupy.broadcast_to(slots_d[:, None], (nseq, nblk)))
            return self.paged_attention(q, k_ring, v_ring, tables, context_lens, cu_seqlens, scale,
                                        sliding_window=w, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        slots_h, ctx_h, cu_h = (cupy.asnumpy(a).astype(np.int64) for a in (slots, context_lens, cu_seqlens))
        start_h = ctx_h - (cu_h[1:] - cu_h[:-1])
        first_h = np.maximum(0, start_h - w + 1)  # earliest position a new query can see
        # local row 0 = position `base`: deterministic attention tiles keys from multiples of the tile width on,
        # as a decode step over the ring does, so the gathered rows start on such a multiple (the rows below the
        # window stay zero and are masked)
        tile = self.tuning.keys_per_tile(q.shape[2]) if self.tuning.deterministic else 1
        base = first_h // tile * tile
        local_len = ctx_h - base
        width = int(local_len.max())
        hkv, d = k.shape[1], k.shape[2]
        tmp_k = cupy.zeros((nseq, width, hkv, d), k_ring.dtype)
        tmp_v = cupy.zeros((nseq, width, hkv, d), v_ring.dtype)
        tmp_ks = tmp_vs = None
        if k_scale is not None:
            tmp_ks = cupy.zeros((nseq, width) + k_scale.shape[2:], F32)
            tmp_vs = cupy.zeros((nseq, width) + v_scale.shape[2:], F32)
        # host-built gather maps: (sequence, local row) <- ring row or new row
        ring_dst, ring_src, new_dst, new_src = gather_rows(slots_h, first_h, start_h, ctx_h, cu_h, base, w, width)
        flat = lambda a: a.reshape((-1,) + a.shape[-2:])
        new_dst, new_src = self.upload_index(new_dst), self.upload_index(new_src)
        if ring_dst.size:
            rd, rs = self.upload_index(ring_dst), self.upload_index(ring_src)
            flat(tmp_k)[rd] = flat(k_ring)[rs]
            flat(tmp_v)[rd] = flat(v_ring)[rs]
            if tmp_ks is not None:
                flat(tmp_ks)[rd] = flat(k_scale)[rs]
                flat(tmp_vs)[rd] = flat(v_scale)[rs]
        if tmp_ks is not None:  # quantised as the ring stores them
            self.write_kv(tmp_k, tmp_v, k[new_src], v[new_src], new_dst, tmp_ks, tmp_vs)
        else:
            flat(tmp_k)[new_dst] = k[new_src].astype(k_ring.dtype)
            flat(tmp_v)[new_dst] = v[new_src].astype(v_ring.dtype)
        tables = self.upload_index(np.arange(nseq)[:, None])
        out = self.paged_attention(q, tmp_k, tmp_v, tables, self.upload_index(local_len), cu_seqlens, scale,
                                   sliding_window=w, sinks=sinks, k_scale=tmp_ks, v_scale=tmp_vs)
        keep_src, keep_at = kept_rows(slots_h, start_h, ctx_h, cu_h, w)
        keep_src = self.upload_index(keep_src)
        self.write_kv(k_ring, v_ring, k[keep_src], v[keep_src], self.upload_index(keep_at), k_scale, v_scale)
        return out
