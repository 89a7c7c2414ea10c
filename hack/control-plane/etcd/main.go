// Command etcd is etcd's own server (go.etcd.io/etcd/server/v3/etcdmain), built from its
// published module so the test control plane needs no download at run time.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
