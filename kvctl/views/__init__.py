"""Everything kvctl shows people or machines: the Output object and one renderer per result.

May import: `kvctl.errors` and the result types of the library packages: `kvctl.attach`,
`kvctl.bench`, `kvctl.cluster`, `kvctl.k8s`, `kvctl.provision`, `kvctl.scenario`, `kvctl.store`,
`kvctl.verify`, `connectors.store`; never a command module.
Library code never prints; commands hand results to a renderer here.
"""
