// An independent Go implementation of docs/keys.md, checked against docs/key-vectors.json, so the key
// spec is proven language-neutral. Run: cd hack/keyspec-go && go test ./...
package keyspec

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"math"
	"os"
	"testing"
)

type vector struct {
	Name  string `json:"name"`
	Model struct {
		ModelID      string `json:"model_id"`
		Revision     string `json:"revision"`
		KVDtype      string `json:"kv_dtype"`
		NumLayers    uint32 `json:"num_layers"`
		NumKVHeads   uint32 `json:"num_kv_heads"`
		HeadDim      uint32 `json:"head_dim"`
		Quantization string `json:"quantization"`
		TenantSalt   string `json:"tenant_salt_hex"`
		KVKind       string `json:"kv_kind"`
	} `json:"model"`
	Request *struct {
		Adapter *struct {
			Name      string `json:"name"`
			DigestHex string `json:"digest_hex"`
		} `json:"adapter"`
		MMItems []struct {
			Modality    string `json:"modality"`
			ContentHash string `json:"content_hash"`
			Offset      uint32 `json:"offset"`
			Length      uint32 `json:"length"`
		} `json:"mm_items"`
		EmbedsDigestHex string   `json:"embeds_digest_hex"`
		Shard           []uint32 `json:"shard"`
		KVScales        *struct {
			K         []float64 `json:"k"`
			V         []float64 `json:"v"`
			DigestHex string    `json:"digest_hex"`
		} `json:"kv_scales"`
	} `json:"request"`
	RequestSaltHex string   `json:"request_salt_hex"`
	Fingerprint    string   `json:"fingerprint"`
	ChunkTokens    int      `json:"chunk_tokens"`
	Tokens         []uint32 `json:"tokens"`
	ChunkKeys      []string `json:"chunk_keys"`
}

func field(tag byte, payload []byte) []byte {
	out := []byte{tag, 0, 0, 0, 0}
	binary.LittleEndian.PutUint32(out[1:], uint32(len(payload)))
	return append(out, payload...)
}

// quantFormat: fingerprint field 7 holds the mode's byte format (docs/keys.md): k8v4 is at format 3, k6v4z at 2.
func quantFormat(mode string) string {
	switch mode {
	case "k8v4":
		return mode + ".3"
	case "k6v4z":
		return mode + ".2"
	}
	return mode
}

func u32(v uint32) []byte {
	b := make([]byte, 4)
	binary.LittleEndian.PutUint32(b, v)
	return b
}

// requestSalt: docs/keys.md, "Request salt (v2)".
func requestSalt(v vector, salt []byte) []byte {
	r := v.Request
	msg := []byte("promptcache/request/v2\x00")
	msg = append(msg, field(1, salt)...)
	if r.Adapter != nil {
		d, _ := hex.DecodeString(r.Adapter.DigestHex)
		msg = append(msg, field(2, []byte(r.Adapter.Name))...)
		msg = append(msg, field(3, d)...)
	}
	for _, m := range r.MMItems {
		msg = append(msg, field(4, []byte(m.Modality))...)
		msg = append(msg, field(5, []byte(m.ContentHash))...)
		msg = append(msg, field(6, append(u32(m.Offset), u32(m.Length)...))...)
	}
	if r.EmbedsDigestHex != "" {
		d, _ := hex.DecodeString(r.EmbedsDigestHex)
		msg = append(msg, field(7, d)...)
	}
	if len(r.Shard) == 6 {
		var b []byte
		for _, x := range r.Shard {
			b = append(b, u32(x)...)
		}
		msg = append(msg, field(8, b)...)
	}
	if r.KVScales != nil {
		msg = append(msg, field(9, scalesDigest(r.KVScales.K, r.KVScales.V))...)
	}
	h := sha256.Sum256(msg)
	return h[:]
}

// scalesDigest: docs/keys.md, an fp8 cache's per-layer scales as float32 little-endian, K then V of each layer.
func scalesDigest(k, v []float64) []byte {
	msg := []byte("promptcache/kv-scales/v1\x00")
	for i := range k {
		msg = append(msg, u32(math.Float32bits(float32(k[i])))...)
		msg = append(msg, u32(math.Float32bits(float32(v[i])))...)
	}
	h := sha256.Sum256(msg)
	return h[:]
}

func TestVectors(t *testing.T) {
	raw, err := os.ReadFile("../../docs/key-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var vectors []vector
	if err := json.Unmarshal(raw, &vectors); err != nil {
		t.Fatal(err)
	}
	if len(vectors) == 0 {
		t.Fatal("no vectors")
	}
	for _, v := range vectors {
		salt, _ := hex.DecodeString(v.Model.TenantSalt)
		if v.Request != nil {
			if s := v.Request.KVScales; s != nil && hex.EncodeToString(scalesDigest(s.K, s.V)) != s.DigestHex {
				t.Errorf("%s: scales digest %x, want %s", v.Name, scalesDigest(s.K, s.V), s.DigestHex)
			}
			salt = requestSalt(v, salt)
			if hex.EncodeToString(salt) != v.RequestSaltHex {
				t.Errorf("%s: request salt %x, want %s", v.Name, salt, v.RequestSaltHex)
			}
		}
		msg := []byte("promptcache/fingerprint/v1\x00")
		msg = append(msg, field(1, []byte(v.Model.ModelID))...)
		msg = append(msg, field(2, []byte(v.Model.Revision))...)
		msg = append(msg, field(3, []byte(v.Model.KVDtype))...)
		msg = append(msg, field(4, u32(v.Model.NumLayers))...)
		msg = append(msg, field(5, u32(v.Model.NumKVHeads))...)
		msg = append(msg, field(6, u32(v.Model.HeadDim))...)
		msg = append(msg, field(7, []byte(quantFormat(v.Model.Quantization)))...)
		msg = append(msg, field(8, salt)...)
		if v.Model.KVKind == "mla" {
			msg = append(msg, field(9, []byte("mla"))...)
		}
		fp := sha256.Sum256(msg)
		if hex.EncodeToString(fp[:]) != v.Fingerprint {
			t.Errorf("%s: fingerprint %x, want %s", v.Name, fp, v.Fingerprint)
		}
		parent := make([]byte, 32)
		n := len(v.Tokens) / v.ChunkTokens
		if n != len(v.ChunkKeys) {
			t.Fatalf("%s: %d whole chunks, %d keys", v.Name, n, len(v.ChunkKeys))
		}
		for i := 0; i < n; i++ {
			m := append([]byte("promptcache/chunk/v1\x00"), fp[:]...)
			m = append(m, parent...)
			for _, tok := range v.Tokens[i*v.ChunkTokens : (i+1)*v.ChunkTokens] {
				m = append(m, u32(tok)...)
			}
			k := sha256.Sum256(m)
			if hex.EncodeToString(k[:]) != v.ChunkKeys[i] {
				t.Errorf("%s: key %d = %x, want %s", v.Name, i, k, v.ChunkKeys[i])
			}
			parent = k[:]
		}
	}
}
