"""The seed / branch / mix / train / eval / report workflow driven by one YAML file (bam-surgery pipeline)."""
