// argocd-lua-health runs an Argo CD resource health script the way Argo CD
// does (gopher-lua, the object as the global `obj`, the returned table's
// `status` and `message`), so the chart's files/argocd-health.lua is tested
// with the interpreter Argo CD embeds.
//
//	argocd-lua-health SCRIPT < object.json   prints {"status": ..., "message": ...}
package main

import (
	"encoding/json"
	"fmt"
	"os"

	lua "github.com/yuin/gopher-lua"
)

// toLua converts decoded JSON as Argo CD's decodeValue does: objects and
// arrays become tables (arrays 1-based), numbers LNumber, nil LNil.
func toLua(L *lua.LState, v interface{}) lua.LValue {
	switch v := v.(type) {
	case nil:
		return lua.LNil
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []interface{}:
		t := L.NewTable()
		for _, item := range v {
			t.Append(toLua(L, item))
		}
		return t
	case map[string]interface{}:
		t := L.NewTable()
		for k, item := range v {
			t.RawSetString(k, toLua(L, item))
		}
		return t
	}
	panic(fmt.Sprintf("unsupported JSON value %T", v))
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: argocd-lua-health SCRIPT < object.json")
		os.Exit(2)
	}
	script, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var obj interface{}
	if err := json.NewDecoder(os.Stdin).Decode(&obj); err != nil {
		fmt.Fprintln(os.Stderr, "reading the object:", err)
		os.Exit(2)
	}
	L := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer L.Close()
	// The libraries Argo CD opens for health scripts.
	for _, lib := range []struct {
		name string
		fn   lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
		{lua.StringLibName, lua.OpenString},
		{lua.MathLibName, lua.OpenMath},
	} {
		L.Push(L.NewFunction(lib.fn))
		L.Push(lua.LString(lib.name))
		L.Call(1, 0)
	}
	L.SetGlobal("obj", toLua(L, obj))
	if err := L.DoString(string(script)); err != nil {
		fmt.Fprintln(os.Stderr, "script error:", err)
		os.Exit(1)
	}
	ret, ok := L.Get(-1).(*lua.LTable)
	if !ok {
		fmt.Fprintln(os.Stderr, "the script did not return a table")
		os.Exit(1)
	}
	out := map[string]string{}
	ret.ForEach(func(k, v lua.LValue) { out[k.String()] = v.String() })
	enc, _ := json.Marshal(out)
	fmt.Println(string(enc))
}
