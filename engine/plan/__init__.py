"""Planning a window: token trie, tasks, the scheduler's admission rule, shards, the trace of what ran."""
