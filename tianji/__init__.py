"""TianJi: highly parallel deep RL training with relaxed assignment dependencies."""

__version__ = "0.1.0"
