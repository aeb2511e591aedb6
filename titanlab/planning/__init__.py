"""What can be decided before any process group exists: the pre-flight (`preflight`), the
layout validator (`validate`) and layout enumeration (`layouts`), and the memory planner
(`memory`, `activation_memory`, `compiled_saved`).

May import every package below `trainer` (it builds meta models, reads configs and
checkpoints, and asks `posttrain` about the teacher).
"""
