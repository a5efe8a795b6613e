"""Model state: regions, handles, pools and their allocators, the checkpoint pool."""
