def reverse_words(text):
    return " ".join(reversed(text.split()))
