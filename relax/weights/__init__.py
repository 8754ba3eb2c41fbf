"""Weight sync from trainer to engines.

- `sync`: the `WeightSync` interface and its paths (`tensor`, `disk`, `distributed`), versioned and
  verified (`--check-weight-update-equal` reads every tensor back); `push_named_tensors` delegates to it.

- `serialize`: SGLang's `/update_weights_from_tensor` payload (ForkingPickler + base64 over shared
  memory, flattened buckets, chunking into buffers of N bytes) and its restricted reader.
- `shm`: the embedded engine's faster same-host format (`load_format="relax_shm"`): one reused /dev/shm
  segment written by the trainer in double-buffered chunks, read by the engine through views (two copies).
- `distributed`: the `/init_weights_update_group` + `/update_weights_from_distributed` protocol
  (a torch.distributed group, gloo on CPU), trainer side and engine side.
The HTTP calls themselves are in `relax.wire.engine_client.EngineClient`.
"""
