"""Worker memory below the engine and its features: every per-block tensor (the K/V cache of each
layer, stage outputs, ...) and the one budget they share (block_tensors.py), on huge pages where
they are large CPU tensors (prefixkv/huge_pages.py). A feature that keeps something per KV block registers a
`BlockTensorSpec` here; it needs nothing of the engine."""
