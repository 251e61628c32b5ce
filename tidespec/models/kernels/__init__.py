"""Tidespec's own CPU kernels and the row-invariant attention and projections built on them."""
