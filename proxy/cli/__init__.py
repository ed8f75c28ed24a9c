"""The `rlproxy` command line: `serve`, `train`, `score`, `export` (`main`), the trainer child
process `serve` starts (`trainer_process`). Every command builds what it needs with
`proxy.runtime.open_runtime`."""
