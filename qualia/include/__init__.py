"""C headers of the qualia ABI (see qualia.get_include())."""
