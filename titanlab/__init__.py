"""titanlab: a PyTorch-native, composable LLM training stack.

The entry points are the modules here (`python -m titanlab.train`, `titanlab.generate`,
`titanlab.preflight`, `titanlab.launcher`); the packages and the one way their imports run are
drawn in docs/architecture.md. Importing `titanlab` itself imports nothing else.
"""
