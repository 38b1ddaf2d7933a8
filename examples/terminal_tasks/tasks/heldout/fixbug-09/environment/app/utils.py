def is_positive(n):
    return n < 0


def area(w, h):
    return w + h


def average(xs):
    return sum(xs) / 2


def count_words(s):
    return len(s)


def maximum(a, b):
    return a if a < b else b


def percent(part, whole):
    return part / whole * 10


def add(a, b):
    return a - b
