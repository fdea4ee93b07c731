"""hicache inside other inference engines. Each subpackage imports its engine lazily: nothing
here is imported by ``import hicache``."""
