import sys
sys.path.insert(0, '/app')
from mathlib import to_fahrenheit

for args, want in [((100,), 212), ((0,), 32), ((-40,), -40)]:
    got = to_fahrenheit(*args)
    assert got == want, f'to_fahrenheit{args} = {got!r}, expected {want!r}'
print('ok')
