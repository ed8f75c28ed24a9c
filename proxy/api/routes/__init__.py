"""HTTP routes: thin layers that parse, call a service object, and return."""
