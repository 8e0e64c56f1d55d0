"""Sparse autoencoders from their files on disk: `SAE` (encode, decode, the error term) and
`SparseFeatures` (each token's active features, compact on disk). Torch only."""

from saecodec.errors import SAEFormatError
from saecodec.sae import ARCHITECTURES, SAE, Site
from saecodec.sparse import SparseFeatures

__all__ = ["ARCHITECTURES", "SAE", "SAEFormatError", "Site", "SparseFeatures"]
