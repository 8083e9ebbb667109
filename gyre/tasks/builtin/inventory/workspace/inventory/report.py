def low_stock(stock, threshold):
    out = []
    for item in stock.items():
        q = stock.quantity(item)
        if q <= threshold:
            out.append((item, q))
    return out
