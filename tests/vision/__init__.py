"""Images at every layer: vision towers in the engine, the image cache, image routes, images under tensor
parallelism and auth."""
