def low_stock(stock, threshold):
    return [(i, stock.quantity(i)) for i in stock.items() if stock.quantity(i) < threshold]
