"""``phasewise record``: a cluster's samples to a Parquet trace file with a provenance header, which
``phasewise replay --format phasewise`` scores offline (docs/results.md, "Record your own cluster")."""
