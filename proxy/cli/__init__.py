"""The `rlproxy` command line: `serve`, `train`, `score`, `export` (`main`), and the one runtime
builder they share (`runtime`)."""
