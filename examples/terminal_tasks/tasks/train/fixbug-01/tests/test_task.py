import sys
sys.path.insert(0, '/app')
from helpers import last

for args, want in [(([1, 2, 3],), 3), ((['a'],), 'a'), (([4, 5],), 5)]:
    got = last(*args)
    assert got == want, f'last{args} = {got!r}, expected {want!r}'
print('ok')
