"""MLA decode backends: registry, capabilities, eligibility, adapters, our Triton kernels.

Importing this package loads no kernel library; adapters import on first use.
"""
