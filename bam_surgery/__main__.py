"""python -m bam_surgery ...: the same as the bam-surgery command."""
from bam_surgery.cli.launch import main

main()
