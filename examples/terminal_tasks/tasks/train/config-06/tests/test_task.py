import json

got = json.load(open('/app/app.json'))
want = {'debug': False, 'log_level': 'debug'}
assert got == want, f'{got!r} != {want!r}'
print('ok')
