"""Pipeline that builds ferryman's bundled demo model; entry point: `python -m tools.demo_model.build`."""
