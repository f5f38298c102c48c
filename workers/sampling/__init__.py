"""Building blocks of the sampler: penalties, logit filters and reproducible noise."""
