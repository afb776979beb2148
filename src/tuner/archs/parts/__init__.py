"""Parts: what only some architectures have (two experts, ...), written once and declared by their records.

A part is switched on by data on the record (`tuner.archs.record.Architecture`: `boundary` for two
experts, ...), and `tuner.archs.model.ArchitectureModel` calls it at one generic point, so the next family
that has the feature declares it rather than overriding a method of its own.
"""
