"""gradmon-ray: per-head gradient health for multi-head PPO policies on Ray RLlib."""

__version__ = "0.1.0"
