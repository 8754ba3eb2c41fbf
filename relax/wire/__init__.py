"""What crosses a process boundary to an engine: its HTTP API client (`engine_client`), the run's engine key
(`auth`), ports and child processes (`net`) and SGLang's tensor payload (`serialize`). The weight paths, the
rollout, the metrics service and the backends all speak through it."""
