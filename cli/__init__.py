"""The command line: every bam-surgery command (click), the console-script entry, the demo. The top layer."""
