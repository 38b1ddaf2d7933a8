import configparser

cp = configparser.ConfigParser()
assert cp.read('/app/service.ini'), 'missing /app/service.ini'
got = dict(cp['app'])
want = {'debug': 'false', 'name': 'web'}
assert got == want, f'{got!r} != {want!r}'
print('ok')
