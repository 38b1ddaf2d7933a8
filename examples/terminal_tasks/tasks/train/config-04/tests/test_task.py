import configparser

cp = configparser.ConfigParser()
assert cp.read('/app/server.ini'), 'missing /app/server.ini'
got = dict(cp['main'])
want = {'workers': '2', 'log_level': 'debug'}
assert got == want, f'{got!r} != {want!r}'
print('ok')
