from inventory.stock import Stock

__all__ = ["Stock"]
