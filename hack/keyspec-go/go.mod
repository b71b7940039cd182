module promptcache.io/keyspec

go 1.22
