import sys
sys.path.insert(0, '/app')
from utils import count_words

for args, want in [(('a b c',), 3), (('hello',), 1), (('one two',), 2)]:
    got = count_words(*args)
    assert got == want, f'count_words{args} = {got!r}, expected {want!r}'
print('ok')
