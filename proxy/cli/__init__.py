"""The `rlproxy` command line: `serve`, `train`, `score`, `export` (`main`). The top room: nothing
else in `proxy` imports it. The trainer child `serve` starts is supervised by
`proxy.trainer_child`. `train` opens the store alone (`proxy.database`); every other command
builds what it needs with `proxy.runtime.open_runtime`."""
