"""The on-device runtime: decoding, sampling, detokenisation."""
