import json

got = json.load(open('/app/settings.json'))
want = {'name': 'api', 'debug': False}
assert got == want, f'{got!r} != {want!r}'
print('ok')
