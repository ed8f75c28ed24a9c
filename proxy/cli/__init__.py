"""The `rlproxy` command line: `serve`, `train`, `score`, `export` (`main`). The top room: nothing
else in `proxy` imports it. The trainer child `serve` starts is supervised by
`proxy.trainer_child`. `train`, `keys`, `status` and `export` open the store alone
(`proxy.database.opened_store`), loading no engine; `serve` and `score` build what they need with
`proxy.runtime.open_runtime`."""
