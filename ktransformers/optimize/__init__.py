"""The rule engine: YAML rules -> a placement plan -> injected operators with loaded weights."""
