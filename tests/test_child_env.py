"""What a child of the server inherits: the allow-list, never a secret."""

from gpuforge.child_env import child_environment, passed


def test_only_the_allow_list_passes_and_no_name_that_holds_a_secret():
    server = {
        "PATH": "/usr/bin",
        "HOME": "/home/gf",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
        "GPUFORGE_CACHE_DIR": "/c",
        "GPUFORGE_ADMIN_KEY": "gf_admin",
        "GPUFORGE_DB": "postgresql://u:pw@h/db",
        "GPUFORGE_API_KEY": "gf_x",
        "HF_TOKEN": "hf_secret",
        "NCCL_AUTH_TOKEN": "t",  # an allowed prefix, a secret's name
        "AWS_SECRET_ACCESS_KEY": "s",
        "DATABASE_URL": "postgresql://u:pw@h/db",
    }
    env = child_environment({"CUDA_VISIBLE_DEVICES": "1", "GPUFORGE_API_KEY": "gf_replica"}, base=server)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/gf",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
        "GPUFORGE_CACHE_DIR": "/c",
        "CUDA_VISIBLE_DEVICES": "1",
        "GPUFORGE_API_KEY": "gf_replica",  # given on purpose by the caller: its own key
    }
    assert not passed("GPUFORGE_ADMIN_KEY") and passed("GPUFORGE_USER_CODE")
