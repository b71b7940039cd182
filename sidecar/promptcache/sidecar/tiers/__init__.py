"""The tier stack (stack.TierStack): memory, then the lower tiers (base.LowerTier): the disk tier (disk.py) and
the cluster tier (cluster.py), asked in that order, with one routine that promotes a chunk into memory."""
from promptcache.sidecar.tiers.base import LowerTier, Record
from promptcache.sidecar.tiers.stack import TierStack

__all__ = ["LowerTier", "Record", "TierStack"]
