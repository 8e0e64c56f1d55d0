"""Sparse autoencoders from their files on disk: `SAE` (encode, decode, the error term) and
`SparseFeatures` (each token's active features, compact on disk). Torch only."""

from saecodec.errors import SAEFormatError
from saecodec.sae import ARCHITECTURES, SAE, Site
from saecodec.sites import SITE_NAMES, site_location, standard_location
from saecodec.sparse import SparseFeatures

__all__ = ["ARCHITECTURES", "SAE", "SITE_NAMES", "SAEFormatError", "Site", "SparseFeatures",
           "site_location", "standard_location"]
