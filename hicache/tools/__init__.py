"""What runs beside the library rather than inside an engine: the trace replay, simulations and
capacity planner (`trace`), the reference engine behind `hicache replay` (`refengine`), the
configuration docs generator (`docgen`) and a local Mooncake master for demos and tests
(`mooncake_local`). The runtime never imports this package."""
