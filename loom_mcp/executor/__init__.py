"""Where jobs run: the devices of this node as a pool of slots (`pool.py`), built from what the
probe found and `[executor]` in loom.toml (`slots.py`). A distributed executor (Ray) would hand
out the same `Placement` for a slot on another node."""
