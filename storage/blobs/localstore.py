"""A blob store on a local (or mounted) directory, with the same contract as the S3 store.

Layout: ``{root}/{key}`` holds the slot file and ``{root}/{key}.meta.json`` its metadata. A write
copies into a temporary file (CRC computed on the way), then claims the generation with
``os.link`` — which fails if the name exists, so two writers can never both succeed, even across
processes on one filesystem — and finally renames the metadata into place. The metadata file is
the commit marker: ``head``/``list`` ignore a slot file without it (a crash between the two steps
leaves the generation claimed but invisible; writers then move on to the next generation).
File work runs in threads (``asyncio.to_thread``); nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import json
import mmap
import os
import shutil
import stat
import sys
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import structlog

from storage.blobs.blobstore import BlobInfo, BlobMeta, BlobStore, ObjectInfo, PutOptions, temp_beside
from storage.blobs.metadata import decode_metadata, encode_metadata, new_writer_id
from storage.checksum import crc32_of_parts
from storage.errors import ChecksumError, NotStored, StorageError, StoreMisconfigured, WriteConflict
from storage.ids import SlotRef, parse_blob_key, tenant_prefix, validate_id
from storage.probe import check_read_back

log = structlog.get_logger("slotkeeper.storage")
_META_SUFFIX = ".meta.json"


class LocalStore(BlobStore):
    """Blob store rooted at ``root``; ``fsync`` makes a returned put durable across power loss."""

    window_bytes = sys.maxsize  # its views are maps of its files (:meth:`view_object`): nothing held

    def __init__(
        self,
        root: str | Path,
        *,
        prefix: str = "slotkeeper",
        fsync: bool = True,
        chunk_size: int = 8 << 20,
        concurrency: int = 2,
    ) -> None:
        super().__init__(prefix)
        if chunk_size < 1 or concurrency < 1:
            raise ValueError("chunk_size and concurrency must be >= 1")
        self.root = Path(root)
        self.fsync = fsync
        self.chunk_size = chunk_size
        # pread/crc32/pwrite release the GIL: a couple of threads copy at about memory speed
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="localstore")

    async def aclose(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True)

    def _path(self, ref: SlotRef) -> Path:
        return self.root / self.key_for(ref)

    async def _put_file(self, ref: SlotRef, path: Path, opts: PutOptions) -> BlobMeta:
        meta = await asyncio.to_thread(self._put, ref, path, opts)
        log.info("storage.upload", store="local", key=meta.key, bytes=meta.size, checksum=meta.checksum)
        return meta

    def _put(self, ref: SlotRef, src: Path, opts: PutOptions) -> BlobMeta:
        expected, dest = opts.crc32, self._path(ref)
        meta_path = dest.with_name(dest.name + _META_SUFFIX)
        if dest.exists() or meta_path.exists():
            raise WriteConflict(f"generation {ref.generation} of session {ref.session} exists")
        dest.parent.mkdir(parents=True, exist_ok=True)
        writer = new_writer_id()
        tmp, meta_tmp = temp_beside(dest, writer), temp_beside(meta_path, writer)
        try:
            size, crc = self._copy(src, tmp)
            if expected is not None and crc != expected:
                raise ChecksumError(
                    f"{src}: crc32 {crc:08x}, expected {expected:08x}", expected=expected, actual=crc
                )
            md = encode_metadata(ref, opts, size=size, crc32=crc, writer=writer)
            with open(meta_tmp, "x") as f:
                json.dump(md, f)
                f.flush()
                self._sync(f.fileno())
            try:
                os.link(tmp, dest)  # the claim: atomic, fails when the name exists
            except FileExistsError as exc:
                raise WriteConflict(f"generation {ref.generation} of session {ref.session} exists") from exc
            os.replace(meta_tmp, meta_path)  # the commit
            self._sync_dir(dest.parent)
        finally:
            tmp.unlink(missing_ok=True)
            meta_tmp.unlink(missing_ok=True)
        return self._head(ref)

    def _copy(self, src: Path, dst: Path, expected_size: int | None = None) -> tuple[int, int]:
        """Copy ``src`` to a new file ``dst`` in parallel chunks; returns (bytes, crc32).

        A source whose size differs from ``expected_size`` is not copied (the caller sees the size).
        """
        fin = os.open(src, os.O_RDONLY)
        try:
            size = os.fstat(fin).st_size
            if expected_size is not None and size != expected_size:
                return size, 0
            fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fout, size)
                jobs = [
                    self._pool.submit(_copy_chunk, fin, fout, off, min(self.chunk_size, size - off))
                    for off in range(0, size, self.chunk_size)
                ]
                wait(jobs)  # every job is done before the descriptors close, failed or not
                crc = crc32_of_parts(
                    [
                        (job.result(), min(self.chunk_size, size - i * self.chunk_size))
                        for i, job in enumerate(jobs)
                    ]
                )
                self._sync(fout)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        return size, crc

    def _sync(self, fd: int) -> None:
        if self.fsync:
            os.fsync(fd)

    def _sync_dir(self, path: Path) -> None:
        if self.fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    async def get_to_file(self, ref: SlotRef, dest: str | Path, *, verify: bool = True) -> BlobMeta:
        meta = await asyncio.to_thread(self._get, ref, Path(dest))
        log.info("storage.download", store="local", key=meta.key, bytes=meta.size, dest=str(dest))
        return meta

    def _get(self, ref: SlotRef, dest: Path) -> BlobMeta:
        meta = self._head(ref)
        if meta.crc32 is None:
            raise ChecksumError(f"object {meta.key} has no checksum metadata")
        tmp = temp_beside(dest, new_writer_id())
        try:
            size, crc = self._copy(self._path(ref), tmp, meta.size)
            if size != meta.size or crc != meta.crc32:
                log.warning("storage.checksum_mismatch", store="local", key=meta.key, bytes=size)
                raise ChecksumError(
                    f"object {meta.key}: got {size} bytes crc32 {crc:08x}, "
                    f"metadata says {meta.size} bytes {meta.checksum}",
                    expected=meta.crc32,
                    actual=crc,
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return meta

    async def head(self, ref: SlotRef) -> BlobMeta:
        return await asyncio.to_thread(self._head, ref)

    def _head(self, ref: SlotRef) -> BlobMeta:
        path = self._path(ref)
        key = self.key_for(ref)
        try:
            with open(path.with_name(path.name + _META_SUFFIX)) as f:
                md = json.load(f)
            st = path.stat()
        except FileNotFoundError as exc:
            raise NotStored(f"no generation {ref.generation} of session {ref.session}") from exc
        except ValueError as exc:
            raise StorageError(f"object {key}: unreadable metadata") from exc
        if not isinstance(md, dict):
            raise StorageError(f"object {key}: metadata is not an object")
        etag = f"{st.st_mtime_ns:x}-{st.st_size:x}"
        return decode_metadata(
            ref, key, st.st_size, st.st_mtime, etag, {str(k): str(v) for k, v in md.items()}
        )

    async def list(self, tenant: str, session: str | None = None) -> AsyncIterator[BlobInfo]:
        base = self.root / tenant_prefix(self.prefix, tenant, session)
        for info in await asyncio.to_thread(self._list, base, tenant, session):
            yield info

    def _list(self, base: Path, tenant: str, session: str | None) -> builtins.list[BlobInfo]:
        found: builtins.list[BlobInfo] = []
        if not base.is_dir():
            return found
        for meta_path in base.rglob(f"*.slot{_META_SUFFIX}"):
            slot = meta_path.with_name(meta_path.name[: -len(_META_SUFFIX)])
            ref = parse_blob_key(self.prefix, slot.relative_to(self.root).as_posix())
            if ref is None or ref.tenant != tenant or (session is not None and ref.session != session):
                continue
            try:
                st = slot.stat()
            except FileNotFoundError:
                continue  # deleted while listing
            found.append(BlobInfo(ref, self.key_for(ref), st.st_size, st.st_mtime))
        return sorted(found, key=lambda i: i.key)

    async def list_tenants(self) -> AsyncIterator[str]:
        for tenant in await asyncio.to_thread(self._tenants):
            yield tenant

    def _tenants(self) -> builtins.list[str]:
        base = self.root / self.prefix if self.prefix else self.root
        if not base.is_dir():
            return []
        names = []
        for entry in base.iterdir():
            try:
                names.append(validate_id(entry.name, "tenant id"))
            except StorageError:
                continue
        return sorted(names)

    async def delete(self, ref: SlotRef) -> None:
        await asyncio.to_thread(self._delete, ref)
        log.info("storage.delete", store="local", key=self.key_for(ref))

    def _delete(self, ref: SlotRef) -> None:
        path = self._path(ref)
        path.with_name(path.name + _META_SUFFIX).unlink(missing_ok=True)  # un-commit first
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:
            pass  # not empty, or gone

    def _put_document(self, dest: Path, data: bytes) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_beside(dest, new_writer_id())
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                self._sync(f.fileno())
            os.replace(tmp, dest)
            self._sync_dir(dest.parent)
        finally:
            tmp.unlink(missing_ok=True)

    async def put_object(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._put_document, self.root / key, data)

    async def get_object(self, key: str) -> bytes:
        try:
            return await asyncio.to_thread((self.root / key).read_bytes)
        except FileNotFoundError:
            raise NotStored(f"object {key} not found") from None

    async def put_object_file(self, key: str, path: Path) -> None:
        await asyncio.to_thread(self._put_file_object, self.root / key, path)

    def _put_file_object(self, dest: Path, path: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_beside(dest, new_writer_id())
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    async def get_object_file(self, key: str, dest: Path) -> int:
        try:
            return await asyncio.to_thread(_copy_new, self.root / key, dest)
        except FileNotFoundError:
            raise NotStored(f"object {key} not found") from None

    async def view_object(self, key: str) -> bytes | mmap.mmap:
        """A read-only map of the object's file, its pages loaded at once (one copy fewer than
        reading it: a restore writes the pieces straight from the page cache). Safe against
        writers and collectors: objects are replaced by rename and deleted by unlink, which leave a
        mapped file as it was until the map is dropped."""
        return (await asyncio.to_thread(self._map_files, [key]))[0]

    async def view_objects(
        self, keys: Sequence[str], gate: asyncio.Semaphore
    ) -> builtins.list[bytes | mmap.mmap]:
        """Every key mapped in one worker thread (no disk to wait on but the page cache's): a
        thread hop per piece costs more than mapping the piece, so a restore's pieces share one hop
        (figures: docs/benchmarks.md, "Figures formerly in code comments")."""
        return await asyncio.to_thread(self._map_files, keys)

    def _map_files(self, keys: Sequence[str]) -> builtins.list[bytes | mmap.mmap]:
        views: builtins.list[bytes | mmap.mmap] = []
        for key in keys:
            try:
                views.append(_map_file(self.root / key))
            except FileNotFoundError:
                raise NotStored(f"object {key} not found") from None
        return views

    async def object_size(self, key: str) -> int | None:
        return await asyncio.to_thread(self._object_size, key)

    def _object_size(self, key: str) -> int | None:
        try:
            st = (self.root / key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    async def list_objects(self, key_prefix: str) -> AsyncIterator[ObjectInfo]:
        for info in await asyncio.to_thread(self._list_objects, key_prefix):
            yield info

    def _list_objects(self, key_prefix: str) -> builtins.list[ObjectInfo]:
        """Keys starting with ``key_prefix``, as S3 lists them (a folder or a whole key)."""
        base = self.root / key_prefix.rpartition("/")[0]
        found: builtins.list[ObjectInfo] = []
        if not base.is_dir():
            return found
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith(".") and name.endswith(".part") or name.endswith(_META_SUFFIX):
                    continue  # a write in progress, or a slot file's metadata
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(key_prefix):
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return sorted(found, key=lambda i: i.key)

    async def delete_object(self, key: str) -> None:
        await asyncio.to_thread(self._delete_object, self.root / key)

    def _delete_object(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:
            pass  # not empty, or gone

    async def probe(self) -> None:
        await asyncio.to_thread(self._probe)
        log.info("storage.probed", store="local", root=str(self.root), prefix=self.prefix)

    def _probe(self) -> None:
        where = f"directory {self.root}"
        path = (self.root / self.prefix if self.prefix else self.root) / ".probe" / uuid.uuid4().hex
        data = os.urandom(256)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(path, "xb") as f:
                    f.write(data)
                    f.flush()
                    self._sync(f.fileno())
                got = path.read_bytes()
            finally:
                path.unlink(missing_ok=True)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
            raise StoreMisconfigured(
                f"local store in {where}: {code}: {exc.strerror or exc}",
                service="local",
                error_code=code,
                where=where,
            ) from exc
        said = f"local store in {where} returned other bytes than were written"
        check_read_back(data, got, said, service="local", where=where)


def _copy_chunk(fin: int, fout: int, offset: int, length: int) -> int:
    data = os.pread(fin, length, offset)
    if len(data) != length:
        raise StorageError("source file shrank during the copy")
    view = memoryview(data)
    while view:
        written = os.pwrite(fout, view, offset)
        view, offset = view[written:], offset + written
    return zlib.crc32(data)


def _map_file(path: Path) -> bytes | mmap.mmap:
    """The file mapped, or read when the process is out of descriptors or maps (each map keeps a
    descriptor of its own until dropped, and a restore holds every piece of its generation)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""  # (an empty file cannot be mapped)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault every page in now
        try:
            return mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise
            return f.read()


def _copy_new(src: Path, dest: Path) -> int:
    """``src`` copied to the new file ``dest`` (which must not exist); its bytes."""
    with open(src, "rb") as fin, open(dest, "xb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        return fout.tell()
