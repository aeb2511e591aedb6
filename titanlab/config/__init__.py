"""The job config: dataclasses of every option (`job_config`), TOML and command-line parsing
(`manager`), the generated option reference (`docs`) and the one-line `ConfigError`.

Imports nothing else from titanlab: every other package may import it.
"""
