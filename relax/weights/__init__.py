"""Weight sync from trainer to engines.

- `serialize`: SGLang's `/update_weights_from_tensor` payload (ForkingPickler + base64 over shared
  memory, flattened buckets, chunking into buffers of N bytes) and its restricted reader.
- `distributed`: the `/init_weights_update_group` + `/update_weights_from_distributed` protocol
  (a torch.distributed group, gloo on CPU), trainer side and engine side.
The HTTP calls themselves are in `relax.backends.engine_client.EngineClient`.
"""
