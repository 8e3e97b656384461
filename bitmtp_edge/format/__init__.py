"""The artifact contract between ``bitmtp-export`` and the runtime.

``manifest`` (schema, reading, checksums, the atomic writer), ``config`` (model,
quantisation and MTP configs), ``segments`` (KV capacity segments), ``tensors`` (tensor
names and draft-head kinds) and ``roles`` (the step widths of every role). The ternary
packing layout stays with the kernels that read it (``kernels_ampere/packing.py``).
"""
