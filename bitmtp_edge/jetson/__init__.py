"""Jetson boards (``board``), the power posture a benchmark needs (``posture``) and the power /
thermal monitors (``monitor``: tegrastats, jtop, NVML, psutil)."""
