import json

got = json.load(open('/app/settings.json'))
want = {'host': 'localhost', 'debug': False}
assert got == want, f'{got!r} != {want!r}'
print('ok')
