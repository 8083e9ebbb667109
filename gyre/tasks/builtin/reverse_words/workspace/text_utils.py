def reverse_words(text):
    """'hello big world' -> 'world big hello'."""
    return text[::-1]
